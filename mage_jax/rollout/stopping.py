"""Safe points of a rollout: after a stop request (SIGTERM / Ctrl-C) the runner ends the rollout at its
next collect (``MetaEpisodeRunner.run(..., stop=event)``), before anything of the abandoned work reaches
the training state."""


class Interrupted(Exception):
    """Raised at a safe point after a stop request: the work in progress (a training iteration or an
    evaluation) is abandoned, and the caller saves the last complete state."""

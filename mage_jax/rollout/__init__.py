"""Rollout: task sampling, the meta-episode runner and its policies, row records and their packing.

Modules are imported by name (``rollout.meta_episode``, ``rollout.policy``, ...)."""

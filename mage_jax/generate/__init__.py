"""Text generation on device: token ids in, sampled responses (tokens, log-probs) out.

* ``step``: the per-token step every program runs (mask, choose, automaton, end of sequence, done),
  the prefill, ``SamplingParams`` and the per-row sampling keys;
* ``shapes``: buckets and padding that bound the number of compiled programs;
* ``constraints``: token automata (legal actions, constrained reflections) shared with the train step;
* ``sampler``: the lockstep program (one batch from prefill to its longest row);
* ``slots``: the engine's device programs (insert, decode, move) over a fixed set of decode slots;
* ``engine``: the continuous-batching scheduler over those slots (the default rollout);
* ``aot``: ahead-of-time lowering of the programs (memory plans).
"""

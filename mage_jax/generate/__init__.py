"""Text generation on device: token ids in, sampled responses (tokens, log-probs) out.

* ``step``: the per-token step every program runs (mask, choose, automaton, end of sequence, done),
  the prefill, ``SamplingParams`` and the per-row sampling keys;
* ``shapes``: buckets and padding that bound the number of compiled programs;
* ``constraints``: token automata (legal actions, constrained reflections) shared with the train step;
* ``spec``: the seams: ``ModelSpec`` (what every program needs of the model) and the ``SlotPrograms``
  protocol (all the engine sees of its programs);
* ``sampler``: the lockstep program (one batch from prefill to its longest row);
* ``slots``: the slot programs on the device (insert, decode, move over a fixed set of decode slots);
* ``engine``: the continuous-batching scheduler over any slot programs (the default rollout);
* ``mage_jax.aot``: ahead-of-time lowering of the programs (memory plans).
"""

"""One sampling step, per row: the knobs (`params`, checked by `checks`), the tokens seen
(`history`), the pure logits transforms (`transforms`), the processor contract
(`processors`), the structured-output masks (`constraints`, step 1 of the sampling order)
and the step itself (`sampler`: `sample`, `sampling_distribution`, `adjust_logits`).

May import: `logitloop.decoding.runtime`, `logitloop.ops`, `logitloop.models`; nothing
from `loop` or `engine`.
"""

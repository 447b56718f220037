"""One sampling step, per row: the settings (`params`: `SamplingParams`, composed of the
sampler's knobs, stop rules, output options, constraints and processors; checked by
`checks`), the tokens seen (`history`), the pure logits transforms (`transforms`), the
processor contract (`processors`), the structured-output masks (`constraints`, step 1 of
the sampling order) and the step itself (`sampler`: `sample`, `sampling_distribution`,
`adjust_logits`).

May import: `logitloop.decoding.runtime`, `logitloop.ops`, `logitloop.models`; nothing
from `loop` or `engine`.
"""

"""Worked examples: whole programs that use several stacklib components together, as a user would.

`resumable_training` is chapter 05's training run that survives being killed (a model,
an optimizer, a data pipeline and checkpoints). Run one as a script,
`python -m stacklib.examples.resumable_training DIR`, or import it.

They are layer 5, beside the capstone: they may import any component below and any real
library, and no component imports them. (Chapter 02's digits classifier, which other
components use, is `stacklib.nn.digits_classifier`.)
"""

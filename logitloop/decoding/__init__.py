"""Sampling parameters, logits transforms, the sampler, stop conditions and the decode loop."""

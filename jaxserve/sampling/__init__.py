"""Sampling on the device: the sampler, logprobs, and structured outputs' token masks."""

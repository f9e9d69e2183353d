"""Sampling: the sampler, the logits processors it applies, logprobs, and the rejection
sampler that verifies speculative drafts."""

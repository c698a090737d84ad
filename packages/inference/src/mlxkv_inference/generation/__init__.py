"""generation: the AR loop, the running sequence, sampler, logits processors, grammar and detokenizer."""

"""Greedy sampling inside the step: the LM head with its argmax, the argmax of its
per-program partials, and the argmax of logits already in memory."""

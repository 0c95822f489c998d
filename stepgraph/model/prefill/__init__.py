"""The prefill paths: packed chunks over cached prefixes, their attention, and the two
captured forms (one whole graph per token bucket, or piecewise per layer)."""

"""Prefill attention: packed chunks over a cached prefix plus their new tokens
(``extend_attention``, SGLang's name for it), its tiles and input checks, the torch
references."""

"""Sampling rules the gateway and the workers share."""

from __future__ import annotations

# A temperature below this samples greedily, as vLLM's (_SAMPLING_EPS) and SGLang's do: logits
# divided by a float32 denormal such as 1e-45 overflow to inf, and a softmax over them is NaN.
# The gateway sends such a temperature as 0; a worker treats any other client's the same way.
GREEDY_BELOW = 1e-5

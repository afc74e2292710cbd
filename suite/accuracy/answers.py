"""The final answer of a MetaMathQA-style response, and exact match against the reference."""
from __future__ import annotations

import re
from fractions import Fraction

_MARK = "The answer is:"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract(text: str) -> str | None:
    """The number after the last "The answer is:", normalised (no thousands commas, no trailing
    zeros, fractions reduced); None when the response gives no final answer."""
    at = text.rfind(_MARK)
    if at < 0:
        return None
    match = _NUMBER.search(text[at + len(_MARK):].strip().split("\n", 1)[0])
    if not match:
        return None
    raw = match.group(0).replace(",", "")
    value = Fraction(raw) if "/" in raw and not raw.endswith("/0") else Fraction(raw.split("/")[0])
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def exact_match(prediction: str, reference: str) -> bool:
    got = extract(prediction)
    return got is not None and got == extract(f"{_MARK} {reference}")

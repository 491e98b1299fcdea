"""Domain-separated HMAC-SHA256 with the run secret, shared by every authenticated record.

The domain (e.g. b"st-store/1") keeps a MAC made for one purpose from verifying for another;
parts are joined with NUL so ("ab", "c") and ("a", "bc") differ.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

MAC_HEX_CHARS = 64


def tagged_mac(secret: bytes, domain: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) with `secret` over `domain` and `parts`, joined by NUL."""
    return hmac.new(secret, b"".join(p + b"\0" for p in (domain, *parts))[:-1],
                    hashlib.sha256).hexdigest()


def mac_matches(got: Any, want: str) -> bool:
    """Whether `got` (as a peer sent it: any value) is the MAC `want`, in constant time."""
    return (isinstance(got, str) and len(got) == MAC_HEX_CHARS
            and hmac.compare_digest(got, want))

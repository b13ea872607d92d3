"""How request ids are made, in one place: every part that names a request uses these.

    HTTP request `cmpl-ab12` with 2 prompts and n = 3:
      prompt requests   cmpl-ab12-p0            cmpl-ab12-p1            (prompt_request_id)
      samples           cmpl-ab12-p0-0 .. -2    cmpl-ab12-p1-0 .. -2    (sample_ids)

A prompt request is what crosses into the engine (one `AddRequest`); the engine fans it out
into its samples, and outputs carry the sample's id. With n = 1 the sample id is the prompt
request's id itself. Nothing parses an id back: whoever needs a sample's request keeps the
mapping it made.
"""

from __future__ import annotations

import uuid


def new_request_id(prefix: str) -> str:
    """A fresh id for a request that came without one (`cmpl-`, `chatcmpl-`, ... + 24 hex)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def prompt_request_id(request_id: str, k: int) -> str:
    """The id of prompt `k` of a request that carries several prompts."""
    return f"{request_id}-p{k}"


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a prompt request's samples: `request_id` for n = 1, else `-0 .. -(n-1)`."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]

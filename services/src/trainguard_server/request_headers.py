"""Request headers that say two things at once, refused the same way by ingest (HTTP and gRPC) and the query
API. One module both import, so the two front doors cannot drift apart:

* :func:`one_authorization`: more than one ``Authorization`` value (HTTP headers, gRPC metadata). Which token
  counts would be a guess: a proxy checking one and the server using another could disagree on whose request
  it is. The caller answers 401 / ``UNAUTHENTICATED`` with the message.
* :func:`framing_conflict`: both ``Content-Length`` and ``Transfer-Encoding``. uvicorn reads such a request as
  chunked (RFC 9112 6.3), but a proxy in front may have framed it by ``Content-Length`` and forwarded the rest
  as another request (request smuggling); no client of ours sends both. The caller answers 400 with
  ``Connection: close``, so nothing after it on that connection is read.

Pure functions of header values; the message is the client's.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["HeaderConflict", "framing_conflict", "one_authorization"]


class HeaderConflict(ValueError):
    """Two ``Authorization`` values; ``str()`` is the message for the client."""


def one_authorization(values: Sequence[str], token_kind: str, *, sent_as: str = "values") -> Optional[str]:
    """The one ``Authorization`` value of a request (None without one); :class:`HeaderConflict` for more than
    one. ``token_kind`` names the token the route wants (``ingest``, ``read``), ``sent_as`` what carried them
    (``values``: HTTP headers or gRPC metadata; ``headers``)."""
    if len(values) > 1:
        raise HeaderConflict(f"{len(values)} Authorization {sent_as} were sent; send exactly one "
                             f"'Bearer <{token_kind} token>'")
    return values[0] if values else None


def framing_conflict(content_length: Optional[str], transfer_encoding: Optional[str]) -> Optional[str]:
    """The client's message when a request has both ``Content-Length`` and ``Transfer-Encoding`` (header
    values, None when absent); None when it is framed one way."""
    if content_length is None or transfer_encoding is None:
        return None
    return (f"the request has both Content-Length ({content_length}) and Transfer-Encoding "
            f"({transfer_encoding}): send one of them")

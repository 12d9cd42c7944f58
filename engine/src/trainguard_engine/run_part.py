"""A run's snapshot part, as :meth:`trainguard_engine.pipeline.Pipeline.changed_parts` hands it out.

Its own module, left pure Python when the engine is compiled (engine/native_build.py): mypyc compiles no
subclass of ``bytes``; ``trainguard_engine.pipeline`` imports it from here, so both names hold.
"""

from __future__ import annotations

from typing import List


class RunPart(bytes):
    """A run's snapshot part (:meth:`Pipeline.changed_parts`): the bytes, and where its ranks are --
    ``self[ranks_at:ranks_end]`` is the JSON list of ``rank_pieces`` (each rank's encoding, in the run's
    order, joined by commas), for a store that keeps ranks apart without parsing the part
    (trainguard_server.processor.rank_parts)."""

    ranks_at: int
    ranks_end: int
    rank_pieces: List[bytes]

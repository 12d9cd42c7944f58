"""Stop 44 (hL3), hR's review: what a HEALTHY log reports it recovered from is not its failure.

* a qualified exception a sentence reports after saying the program retries or falls back (``Retrying in 1s
  [Retry 1/5].  requests.exceptions.ConnectionError: ...``) is not read as an exception line
  (:func:`quoted_exception`, ``_HANDLED_LEAD_RE``);
* an inline exception, and c10d's warning for one failed connect attempt (``[W socket.cpp:558] [c10d] The
  client socket has failed to connect to [localhost]:29500 (errno: 99 - ...)``, pytorch/PiPPy#158: healthy
  runs print it while the master comes up), open nothing when the log goes on training after them; a paste
  that ends in them (or in the error they end in) still opens its incident.

Healthy-run lines are hR's probes (/tmp/hR/cls44.py) and PiPPy#158's warning; the training lines around them
are written for the shape."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from trainguard_server.replay.logs import LogSegmenter, quoted_exception

from .local_import import imported, pasted, shown

RETRY = ("Retrying in 1s [Retry 1/5].  requests.exceptions.ConnectionError: ('Connection aborted.', "
         "RemoteDisconnected('Remote end closed connection without response'))")
FALLBACK = ("Could not import flash attention, falling back to eager.  transformers.utils.import_utils."
            "OptionalDependencyNotAvailableError: flash_attn is not installed")
END_OF_DATA = ("Finished the epoch: end of data.  tensorflow.python.framework.errors_impl.OutOfRangeError: End "
               "of sequence")
INLINE = ("It fails the same way for me.    tensorflow.python.framework.errors_impl.ResourceExhaustedError: "
          "/data/run/variables_temp/part-00000; No space left on device")
CONNECT_W = ("[W socket.cpp:558] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - "
             "Cannot assign requested address).")
CONNECT_W_NEW = ("[W427 01:04:16.149509694 socket.cpp:752] [c10d] The client socket has failed to connect to "
                 "[::ffff:198.18.0.1]:3254 (errno: 110 - Connection timed out).")
TRAINING = [f"Epoch 1 step {i}/500 loss {2.3 - i * 0.004:.3f} lr 3e-4" for i in range(0, 500, 50)]
DONE = "Training completed. Saving model to ./out"


@pytest.mark.parametrize("line", [RETRY, FALLBACK,
                                  "Download failed, will try again.  urllib3.exceptions.ReadTimeoutError: x",
                                  "Skipping the corrupt shard.  datasets.builder.DatasetGenerationError: y"])
def test_handled_inline_exception_is_not_read(line: str) -> None:
    assert quoted_exception(line) is None


@pytest.mark.parametrize("lines", [
    [*TRAINING, RETRY, *TRAINING, DONE],
    [FALLBACK, *TRAINING, DONE],
    [*TRAINING, END_OF_DATA, *TRAINING, DONE],          # no recovery word: the training after it says so
    [*TRAINING, INLINE, *TRAINING, DONE],
    [CONNECT_W, CONNECT_W, *TRAINING, DONE],
    ["[rank1]:" + CONNECT_W_NEW, *TRAINING],
])
def test_healthy_log_opens_nothing(tmp_path: Path, lines: List[str]) -> None:
    assert shown(imported(pasted(tmp_path, lines))) == []


@pytest.mark.parametrize("lines, kind", [
    ([*TRAINING, END_OF_DATA], "process/exception"),
    (["I am hitting this too.", INLINE], "process/exception"),
    ([CONNECT_W_NEW] * 3, "comm/init-failure"),                  # a paste that ends in the attempts
    (TRAINING[:1] + [CONNECT_W] * 2, "comm/init-failure"),
])
def test_log_that_stops_there_still_opens_it(tmp_path: Path, lines: List[str], kind: str) -> None:
    assert shown(imported(pasted(tmp_path, lines)))[:1] == [kind]


def test_unsettled_items_keep_line_order() -> None:
    """An item held until the log shows whether it went on is released in line order with the rest."""
    seg = LogSegmenter(headless=True)
    for number, line in enumerate(["ERROR first", CONNECT_W, "ERROR third"], 1):
        seg.feed(number, line, None)
        assert all(item.line < 2 for item in seg.take())
    items = seg.flush()
    assert [item.line for item in items] == [2, 3] and seg.stats.log_lines == 3

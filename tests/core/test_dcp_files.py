"""`megatron_pp.core.dcp_files`: a chunked tensor written and read back by region, and a `.metadata`
index that names anything but DCP's own classes refused before it can run."""
from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from megatron_pp.core.dcp_files import ChunkToWrite, DcpIndex, write_dcp


def test_chunks_stream_in_order_and_regions_read_back(tmp_path):
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).view(4, 6, 3)
    # Two chunks per "layer" along dim 1, written in the order given and asked for in that order.
    chunks = [ChunkToWrite("w", (4, 6, 3), (layer, half * 3, 0), (1, 3, 3), torch.float32, (layer, half))
              for layer in range(4) for half in range(2)]
    asked = []

    def fetch(source):
        asked.append(source)
        layer, half = source
        return full[layer, half * 3:(half + 1) * 3]

    buffer = io.BytesIO()
    torch.save([None], buffer)
    write_dcp(str(tmp_path), chunks, {"obj/shard_0_1": buffer.getvalue()}, fetch)
    assert asked == [c.source for c in chunks]
    index = DcpIndex(str(tmp_path))
    assert index.keys["w"].shape == (4, 6, 3) and index.keys["obj/shard_0_1"] is None
    assert torch.equal(index.read("w", (2, 0, 0), (1, 6, 3)), full[2:3])  # across both chunks of a layer
    assert torch.equal(index.read("w", (0, 2, 1), (4, 2, 2)), full[:, 2:4, 1:3])


def test_an_index_naming_other_code_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"refusing to unpickle (posix|os)\.system"):
        DcpIndex(str(tmp_path))
    assert not marker.exists()

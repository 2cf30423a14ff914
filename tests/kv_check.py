"""Test helper: wrap an engine's KV store so every location `locate` returns is checked against a
DenseKV mirror of all stored rows (invariant I2: the row at each location is exactly the selected
row of the right request)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhisparse.core.batch import KVContext
from dhisparse.core.rows import gather_rows
from dhisparse.kv.resident.dense import DenseKV

if TYPE_CHECKING:
    from dhisparse.engine.llm import LLM


class CheckedContext(KVContext):
    """Wraps a pass's KVContext; mirrors every stored row into a DenseKV and asserts that each
    location `locate` returns holds exactly the selected row of the right request (I2)."""

    def __init__(self, inner, dense: DenseKV, batch, slots):
        self.inner, self.dense, self.batch = inner, dense.begin(batch, slots), batch

    def store(self, layer, latent, index_key):
        self.inner.store(layer, latent, index_key)
        self.dense.store(layer, latent, index_key)

    def index_keys(self, layer, req):
        return self.inner.index_keys(layer, req)

    def index_table(self, layer):
        return self.inner.index_table(layer)

    def row_formats(self):
        return self.inner.row_formats()

    def finish(self):
        self.inner.finish()

    def locate(self, layer, selection):
        rows, loc = self.inner.locate(layer, selection)
        want_rows, want_loc = self.dense.locate(layer, selection)
        ok = loc >= 0
        assert torch.equal(ok, want_loc >= 0)
        torch.testing.assert_close(gather_rows(rows, loc[ok]), gather_rows(want_rows, want_loc[ok]), rtol=0, atol=0)
        return rows, loc


def checked(llm: LLM) -> LLM:
    store = llm.engine.store
    dense = DenseKV(llm.engine.model_config, formats=store.arena.formats)  # FP8: compares the stored bytes
    names: dict[object, int] = {}
    orig = store.context

    def context(batch, reqs):
        return CheckedContext(orig(batch, reqs), dense, batch, [names.setdefault(r, len(names)) for r in reqs])

    orig_write = store.write_rows

    def write_rows(req, latent, index, start=0):
        orig_write(req, latent, index, start)
        slot = names.setdefault(req, len(names))
        for layer in range(latent.shape[0]):
            dense.latent[(slot, layer)] = latent[layer].to(store.device).clone()
        for j, layer in enumerate(store.arena.layout.index_layers):
            dense.index[(slot, layer)] = index[j].to(store.device).clone()

    store.context, store.write_rows = context, write_rows
    if hasattr(store, "import_prefix"):  # the engine imports stored prefixes whole pages at a time
        orig_import = store.import_prefix

        def import_prefix(req, item, n):
            orig_import(req, item, n)
            slot = names.setdefault(req, len(names))
            for layer in range(item.latent.shape[0]):
                dense.latent[(slot, layer)] = item.latent[layer, :n].to(store.device).clone()
            for j, layer in enumerate(store.arena.layout.index_layers):
                dense.index[(slot, layer)] = item.index[j, :n].to(store.device).clone()

        store.import_prefix = import_prefix
    return llm

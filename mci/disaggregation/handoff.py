"""Building an engine's side of the KV handoff from its configuration."""

from __future__ import annotations

import os

import torch

from mci.cache.page_keys import cache_identity, checkpoint_fingerprint
from mci.disaggregation.config import DisaggregationConfig
from mci.disaggregation.decode_side import DecodeSide
from mci.disaggregation.prefill_side import PrefillSide
from mci.disaggregation.region import KVRegion
from mci.disaggregation.transport import open_transport


def open_handoff(
    config: DisaggregationConfig,
    kv_cache: torch.Tensor,
    model_path: str | os.PathLike,
    batch_invariant: bool,
) -> PrefillSide | DecodeSide:
    """The transport with `kv_cache` registered, and this engine's side. Both sides must
    hold latents computed the same way (checkpoint, dtype, layout, batch invariance): the
    decode side sends its identity and the prefill side refuses any other."""
    rows, _, latent = kv_cache.shape
    identity = cache_identity(
        checkpoint_fingerprint(model_path),
        dtype=str(kv_cache.dtype),
        rows=rows,
        latent=latent,
        batch_invariant=batch_invariant,
        handoff=1,
    )
    transport = open_transport(
        config.disaggregation_transfer_backend,
        config.disaggregation_host,
        config.disaggregation_ib_device,
        config.disaggregation_transfer_timeout,
    )
    transport.register(kv_cache)
    region = KVRegion.of(transport.session_id, kv_cache)
    timeout = config.disaggregation_transfer_timeout
    if config.disaggregation_mode == "prefill":
        return PrefillSide(
            transport,
            region,
            identity,
            config.disaggregation_host,
            config.disaggregation_bootstrap_port,
            timeout,
        )
    return DecodeSide(transport, region, identity, timeout)

"""Prefill-decode disaggregation: prefill and decode workers, the KV handoff between them
(a bootstrap handshake, then a read over a transfer engine), and the transport seam
(docs/disaggregation.md)."""

"""KV transfer between prefill and decode ranks; see docs/transfer.md.

Modules: contract (layout contract), plan (byte-range planning), backend / mooncake / nixl
(the wire), bootstrap (the rendezvous service), room / sender / receiver (per-room state
machines), manager (KVTransferManager, the engine's entry point). Kept import-free so that
`transfer.config` stays cheap for config loaders.
"""

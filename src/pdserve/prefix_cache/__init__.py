"""What every process agrees on about cached KV blocks: content hashes and the KV events wire.

Pure and shared: the engine hashes and publishes with it, a router or indexer (the proxy, a test)
recomputes hashes from token ids and subscribes with it. Knows neither the engine nor torch.
"""

"""Model delivery: the organisation's model reaches each laptop from the trunk server.

The server ships a *client part* — the tokenizer and chat template, the config, and a weights
file with only the embedding, the first and last ``k_max`` layers, the final norm and the LM
head (plus the model's draft head and audit results when it has them) — described by a
manifest it signs with its Ed25519 key. The client fetches it in chunks over its CURVE
connection, checks every chunk, and keeps it per part in the user cache.

* :mod:`engine.delivery.manifest`: the manifest, hashing, signatures.
* :mod:`engine.delivery.part`: making a part from a model (GGUF or safetensors subsets).
* :mod:`engine.delivery.fetch`: the client's fetch, cache and resume.
* :mod:`engine.delivery.client`: a client model from the server's part (``veil`` with only an
  invite).
"""

"""The layers a decoder is built of: its blocks, attention (``attention``: grouped-query and latent) and the MLPs
(``mlp``: gated, and the mixture of experts with shared experts; ``moe``: the routing and the routed experts), and
what they share: norms (``norm``), rotary embeddings (``rope``) and the linear product (``linear``). Pure functions
of arrays; ``jaxserve.models.decoder`` composes them."""

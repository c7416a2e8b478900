"""The layers a decoder is built of: norms (``norm``), rotary embeddings (``rope``) and the linear product
(``linear``). Pure functions of arrays; the models in ``jaxserve.models`` compose them."""

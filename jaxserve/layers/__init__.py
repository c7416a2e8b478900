"""The layers a decoder is built of: norms (``norm``), rotary embeddings (``rope``), the linear product
(``linear``) and the mixture-of-experts block (``moe``). Pure functions of arrays; the models in
``jaxserve.models`` compose them."""

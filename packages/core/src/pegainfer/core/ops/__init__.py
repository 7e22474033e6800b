"""Plain torch implementations of the ops model lines share.  They run anywhere, define the
semantics, and are the reference every fast kernel is tested against. Each follows Hugging Face
transformers' numerics (where it casts, in what order)."""

"""te_compile: a torch.compile backend for TransformerEngine-style FP8/FP4 training."""

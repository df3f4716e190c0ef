"""Building blocks shared by the model families: linear, norm, rotary, attention, dense MLP, MoE."""

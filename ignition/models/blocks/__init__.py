"""Building blocks every family composes: norms, rotary, attention, MLP/MoE, indexers, recurrent
mixers and checkpoint loading. Nothing here knows a family by name: what only one family needs
lives in that family's module (ignition/models/<family>.py)."""

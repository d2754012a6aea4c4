"""Capture: nn.Module / callable -> aten FX graph (torch.export or torch.compile + AOTAutograd)."""

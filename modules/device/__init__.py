"""Where and how a rank computes: device, placement, precision, compile, FLOP/s."""

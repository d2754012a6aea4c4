"""Tuning: what the present GPU can do (device ceilings, measured once and cached on disk per
device name), so cost models and reports divide by this card's numbers rather than a datasheet's."""

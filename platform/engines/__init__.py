"""How the control plane tells engines about registry changes."""

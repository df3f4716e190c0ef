"""Settings and security helpers of the control plane."""

"""HTTP API of the control plane: dependencies, error mapping and one router per resource."""

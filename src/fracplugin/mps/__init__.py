"""MPS: paths (layout), the control CLI (control) and the supervisor thread."""

"""fracplugin: the node half of memory-enforced GPU sharing on Kubernetes."""

__version__ = "0.1.0"

"""Example subjects for ``replay``: engines written the way their users write them."""

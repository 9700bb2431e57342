"""The gRPC edge: servicers, conversions, the error table and interceptors."""

"""Ray Serve deployment of raysd: router (ingress + round loop), draft workers, target workers."""

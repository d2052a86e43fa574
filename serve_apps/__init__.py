"""Ray Serve applications: `serve run serve_apps.classifier:app`, `serve deploy serve_apps/config.yaml`."""

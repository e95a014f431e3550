"""Engine plugins of dyn: each subpackage adapts one inference library to `dynamo_cli.engine.Engine`."""

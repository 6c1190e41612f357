"""What every trl-scale trainer shares."""

TRL_SCALE_TAG = "trl-scale"

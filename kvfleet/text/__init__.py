"""Values as the operator commands read and write them: argparse value types for their flags
(`arg_types`) and human-readable numbers for their output (`units`); below every command."""

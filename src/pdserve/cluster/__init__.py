"""P/D on a Ray cluster (`pdserve up --ray`, `pdserve ray scale|status`); Ray itself is optional."""

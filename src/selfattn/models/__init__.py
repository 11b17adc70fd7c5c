"""Models built from our layers: BERT-family encoder, GPT-family decoder, checkpoint loading."""

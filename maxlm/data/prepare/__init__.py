"""`python -m maxlm.data prepare`: building the packed caches from raw documents, with the
document filters and MinHash near-duplicate removal, in local worker processes or Apache Beam."""

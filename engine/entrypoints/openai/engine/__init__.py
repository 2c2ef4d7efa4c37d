"""Protocol types and the base class shared by every OpenAI endpoint."""

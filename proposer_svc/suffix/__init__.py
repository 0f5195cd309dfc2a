"""The suffix proposer: index, trees and cache (``core``), its service, and sharing through Redis."""

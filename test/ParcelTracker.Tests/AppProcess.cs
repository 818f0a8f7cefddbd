using ExactlyOnce.TestHost;

namespace ParcelTracker.Tests;

/// <summary>The Parcel Tracker executable as a separate process: a role, or the demo.</summary>
internal sealed class AppProcess(params string[] args) : TestProcess("ParcelTracker.dll", args);

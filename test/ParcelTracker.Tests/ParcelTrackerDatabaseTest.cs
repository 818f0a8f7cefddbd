using Xunit;

namespace ParcelTracker.Tests;

/// <summary>
/// A test class that runs the Parcel Tracker against a fresh PostgreSQL database of its own, with the Parcel Tracker's
/// fixed-name queues emptied first (they outlive any one test), and drops the database afterwards.
/// </summary>
public abstract class ParcelTrackerDatabaseTest : IAsyncLifetime
{
    /// <summary>The connection string of this test's database.</summary>
    protected string Database { get; private set; } = "";

    public async Task InitializeAsync()
    {
        await Services.DeleteParcelTrackerQueuesAsync();
        Database = await Services.CreateDatabaseAsync();
    }

    public Task DisposeAsync() => Services.DropDatabaseAsync(Database);
}

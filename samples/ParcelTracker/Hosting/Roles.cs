namespace ParcelTracker.Hosting;

/// <summary>What a process runs. <c>all</c> runs everything in one process.</summary>
[Flags]
public enum Roles
{
    None = 0,
    Api = 1,
    Consumer = 2,
    Worker = 4,
    All = Api | Consumer | Worker,
}
